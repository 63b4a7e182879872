"""The benchmark's data: a 15-column orders table, its starting rows and Debezium change events.

Pure Python (numpy for the random draws), so that the reference replay is independent of the
Spark code it judges.

- The starting table holds the even ids 2, 4, ..., 2N; its rows are a function of the id
  (`start_row` here, `START_COLUMNS` in Spark SQL for building it), so it is built directly
  with Spark, not through CDC.
- Events: about 70% updates, 20% inserts, 10% deletes, Debezium JSON without the schema
  wrapper (decimals as strings, timestamps as epoch microseconds, dates as epoch days), keyed
  by `{"id": n}`, `source.lsn` increasing. Updates and deletes pick their key by a Zipf rank
  (exponent `ZIPF_A`), so a few keys take many of an hour's events.
- Layout "a": inserts take increasing new ids above the table, and rank r is the r-th newest
  key (recent keys are hot, the changed keys sit at the end of the id range). Layout "b":
  inserts take random odd ids inside the table's range, and ranks map to keys spread uniformly
  over the whole range.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal

import numpy as np
import pyarrow as pa

TABLE = "bench_orders"
PRIMARY_KEY = "id"
COLUMNS = {
    "id": "bigint",
    "customer_id": "bigint",
    "status": "string",
    "sku": "string",
    "quantity": "int",
    "unit_price": "decimal(12,2)",
    "total": "decimal(12,2)",
    "currency": "string",
    "channel": "string",
    "note": "string",
    "is_gift": "boolean",
    "weight_kg": "double",
    "created_at": "timestamp",
    "updated_at": "timestamp",
    "ship_date": "date",
}
STATUSES = ("new", "paid", "packed", "shipped", "delivered")
CURRENCIES = ("EUR", "USD", "GBP", "SEK")
CHANNELS = ("web", "app", "store")
FILLER = "x" * 110  # keeps a row near 400 bytes of JSON, an update near 1 KB with its before
BASE_US = 1_735_689_600_000_000  # 2025-01-01 UTC, microseconds
BASE_DAY = 20_089  # 2025-01-01, days since the epoch
FIRST_LSN = 10**12  # above every starting row's sequence (its id)
ZIPF_A = 1.3
OP_WEIGHTS = {"u": 0.7, "c": 0.2, "d": 0.1}

# The starting rows in Spark SQL over a column `id`, the same values as `start_row`.
START_COLUMNS = {
    "customer_id": "id % 100000 + 1",
    "status": f"element_at(array{STATUSES}, cast(id % 5 + 1 as int))",
    "sku": "concat('SKU-', lpad(cast(id % 9973 as string), 5, '0'))",
    "quantity": "cast(id % 7 + 1 as int)",
    "unit_price": "cast((id % 10000) / 100 as decimal(12,2))",
    "total": "cast((id % 10000) / 100 * (id % 7 + 1) as decimal(12,2))",
    "currency": f"element_at(array{CURRENCIES}, cast(id % 4 + 1 as int))",
    "channel": f"element_at(array{CHANNELS}, cast(id % 3 + 1 as int))",
    "note": f"concat('note ', cast(id as string), ' {FILLER}')",
    "is_gift": "id % 11 = 0",
    "weight_kg": "(id % 500) / 10.0",
    "created_at": f"timestamp_micros({BASE_US} + id * 1000)",
    "updated_at": f"timestamp_micros({BASE_US} + id * 1000)",
    "ship_date": f"date_add(date'1970-01-01', cast({BASE_DAY} + id % 365 as int))",
}


def arrow_json_type(kind: str) -> pa.DataType:
    """The Arrow type of a `kind` column's value in the events' JSON (Debezium's encoding)."""
    encoded = {"timestamp": pa.int64(), "date": pa.int32(), "decimal(12,2)": pa.string()}
    plain = {
        "bigint": pa.int64(),
        "int": pa.int32(),
        "string": pa.string(),
        "boolean": pa.bool_(),
        "double": pa.float64(),
    }
    return encoded.get(kind) or plain[kind]


def arrow_table_values(encoded: pa.Array, kind: str) -> pa.Array:
    """JSON-encoded values (`arrow_json_type`) converted to the type the tables store."""
    if kind == "timestamp":  # epoch microseconds
        return encoded.cast(pa.timestamp("us")).cast(pa.timestamp("us", tz="UTC"))
    if kind == "date":  # epoch days
        return encoded.cast(pa.date32())
    if kind == "decimal(12,2)":  # a string
        return encoded.cast(pa.decimal128(12, 2))
    return encoded


def start_row(key: int) -> dict:
    """The starting table's row of `key`, in Debezium's JSON encoding."""
    price = Decimal(key % 10000) / 100
    return {
        "id": key,
        "customer_id": key % 100000 + 1,
        "status": STATUSES[key % 5],
        "sku": f"SKU-{key % 9973:05d}",
        "quantity": key % 7 + 1,
        "unit_price": f"{price:.2f}",
        "total": f"{price * (key % 7 + 1):.2f}",
        "currency": CURRENCIES[key % 4],
        "channel": CHANNELS[key % 3],
        "note": f"note {key} {FILLER}",
        "is_gift": key % 11 == 0,
        "weight_kg": (key % 500) / 10.0,
        "created_at": BASE_US + key * 1000,
        "updated_at": BASE_US + key * 1000,
        "ship_date": BASE_DAY + key % 365,
    }


@dataclass
class Event:
    key: int
    op: str
    lsn: int
    timestamp_ms: int
    row: dict | None  # after-image (None for a delete)
    before: dict | None

    def kafka_key(self) -> bytes:
        return json.dumps({PRIMARY_KEY: self.key}).encode()

    def kafka_value(self) -> bytes:
        return json.dumps(
            {
                "before": self.before,
                "after": self.row,
                "source": {
                    "version": "2.7.0.Final",
                    "connector": "postgresql",
                    "name": "bench",
                    "ts_ms": self.timestamp_ms,
                    "snapshot": "false",
                    "db": "shop",
                    "schema": "public",
                    "table": "orders",
                    "txId": self.lsn // 8,
                    "lsn": self.lsn,
                },
                "op": self.op,
                "ts_ms": self.timestamp_ms,
            },
            separators=(",", ":"),
        ).encode()


@dataclass
class Workload:
    """Generates the changes of consecutive hours against a starting table of `rows` rows,
    remembering the newest state of every key it changed (the reference)."""

    rows: int
    layout: str  # "a" or "b"
    seed: int = 7
    changed: dict[int, dict | None] = field(default_factory=dict)  # key → row, None: deleted
    _keys: list[int] = field(default_factory=list)  # live or deleted, in order of creation
    _next_lsn: int = FIRST_LSN
    _next_new: int = 0

    def __post_init__(self) -> None:
        if self.layout not in ("a", "b"):
            raise ValueError(f"layout must be 'a' or 'b', not {self.layout!r}")
        self._rng = np.random.default_rng(self.seed)
        self._next_new = 2 * self.rows + 1

    def _key_count(self) -> int:
        return self.rows + len(self._keys)

    def _key_at(self, index: int) -> int:
        """The index-th key in order of creation: the starting table's, then inserted ones."""
        return 2 * (index + 1) if index < self.rows else self._keys[index - self.rows]

    def _existing(self, rank: int) -> int:
        count = self._key_count()
        rank = (rank - 1) % count
        if self.layout == "a":  # the rank-th newest key
            return self._key_at(count - 1 - rank)
        # A fixed odd multiplier permutes the starting keys: the hot keys stay the same all
        # along and land anywhere in the range.
        return self._key_at((rank * 2_654_435_761 + 12_345) % self.rows)

    def _new_key(self) -> int:
        if self.layout == "a":
            key, self._next_new = self._next_new, self._next_new + 1
            return key
        while True:  # a random odd id inside the range, not used yet
            key = int(self._rng.integers(0, self.rows)) * 2 + 1
            if key not in self.changed:
                return key

    def current(self, key: int) -> dict | None:
        if key in self.changed:
            return self.changed[key]
        return start_row(key) if key % 2 == 0 and key <= 2 * self.rows else None

    def hour(self, events: int, start_ms: int) -> Iterator[Event]:
        """`events` changes stamped evenly inside the hour that starts at `start_ms`."""
        ops = self._rng.choice(list(OP_WEIGHTS), size=events, p=list(OP_WEIGHTS.values()))
        ranks = self._rng.zipf(ZIPF_A, size=events)
        values = self._rng.integers(0, 1_000_000, size=events)
        step = 3_600_000 / max(events, 1)
        for i in range(events):
            op, ts = str(ops[i]), start_ms + int(i * step)
            key = self._new_key() if op == "c" else self._existing(int(ranks[i]))
            before = None if op == "c" else self.current(key)
            if op != "c" and before is None:  # the key was deleted: insert it again
                op = "c"
            lsn, self._next_lsn = self._next_lsn, self._next_lsn + 1
            if op == "c" and key not in self.changed and not self._is_start_key(key):
                self._keys.append(key)
            row = None if op == "d" else self._changed_row(key, before, int(values[i]), ts)
            self.changed[key] = row
            yield Event(key, op, lsn, ts, row, before)

    def _is_start_key(self, key: int) -> bool:
        return key % 2 == 0 and key <= 2 * self.rows

    @staticmethod
    def _changed_row(key: int, before: dict | None, value: int, ts_ms: int) -> dict:
        row = dict(before) if before is not None else start_row(key)
        price = Decimal(value % 100000) / 100
        quantity = value % 9 + 1
        row.update(
            {
                "id": key,
                "status": STATUSES[value % 5],
                "quantity": quantity,
                "unit_price": f"{price:.2f}",
                "total": f"{price * quantity:.2f}",
                "note": f"note {key} v{value} {FILLER}",
                "weight_kg": (value % 5000) / 10.0,
                "updated_at": ts_ms * 1000,
            }
        )
        if before is None:
            row["created_at"] = ts_ms * 1000
        return row
