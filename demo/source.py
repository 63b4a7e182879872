"""An in-memory shop database (customers, orders, order items) and its Debezium connector.

`DemoSource` keeps the source database's true state and, for each UTC hour it is asked for,
commits a random but seed-deterministic mix of transactions, emitting the change events a
Debezium Postgres connector (2.7, ``decimal.handling.mode=string``,
``time.precision.mode=adaptive``, REPLICA IDENTITY FULL) would publish:

- value: the envelope ``{"before", "after", "source", "transaction", "op", "ts_ms", ...}``,
  wrapped as ``{"schema": ..., "payload": envelope}`` for the tables in ``wrapped``;
- key: the primary key as JSON (wrapped the same way as the value);
- ``source.lsn`` is one counter across all tables, strictly increasing in commit order; the
  records are returned in that order.

It also imitates what a real connector and producer get wrong, so the pipeline is tested on it:

- every delete is followed by a Kafka tombstone (same key, null value);
- ~5% of the change records carry a producer timestamp (CreateTime) 1–20 minutes in the past,
  so timestamps inside a partition are not monotonic and some fall into the previous hour;
- once or twice per table and `generate` call, a connector restart re-sends the table's last
  3–10 records unchanged (kind ``duplicate``);
- about 1% of each table's records are malformed (kind ``malformed``), at least one of each
  kind in `MALFORMED_KINDS` per table when ``changes_per_hour >= 50``. They are not changes:
  the state ignores them, and the LSN they carry (anchor + 1) is never used by a real change.

The column names and types come from the tables' `TableSpec`s; the business rules (orders
belong to existing customers, items to existing orders, totals are the sum of the items)
assume the three demo tables by name.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, NamedTuple

from cdc_assets.config import TableSpec

DEMO_TABLES = ("customers", "orders", "order_items")
DEFAULT_WRAPPED = frozenset({"orders"})
RECORD_KINDS = ("change", "tombstone", "duplicate", "malformed")
MALFORMED_KINDS = ("not_json", "missing_op", "unknown_op", "wrong_type", "missing_pk")

SERVER_NAME = "demo"
DATABASE = "shop"
SCHEMA = "public"
CONNECTOR_VERSION = "2.7.0.Final"


def as_generated(specs: Iterable[TableSpec]) -> list[TableSpec]:
    """The specs as the generator's events are read: without a schema, decimals are text
    (the connector's ``decimal.handling.mode=string``), every other value in its default
    encoding; the wrapped tables' schemas say the same."""
    return [spec.model_copy(update={"decimal_handling": "string"}) for spec in specs]


_NATURAL_KEYS = {
    "customers": ("customer_id",),
    "orders": ("order_id",),
    "order_items": ("order_id", "line_no"),
}
_HOUR_MS = 3_600_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_DATE = date(1970, 1, 1)
_DECIMAL_TYPE = re.compile(r"^decimal\((\d+),\s*(\d+)\)$")
_OUT_OF_ORDER_RATE = 0.05
_MALFORMED_RATE = 0.01
_HOT_KEY_RATE = 0.5  # share of updates that hit a key already changed this hour
_MAX_LINES = 8

_FIRST_NAMES = (
    "Ada", "Alan", "Grace", "Linus", "Margaret", "Ken", "Barbara", "Edsger", "Frances",
    "Dennis", "Radia", "José", "Zoë", "Søren", "Chloé", "Hedy", "Katherine", "Tim", "Anita",
    "Donald",
)  # fmt: skip
_LAST_NAMES = (
    "Lovelace", "Turing", "Hopper", "Torvalds", "Hamilton", "Thompson", "Liskov", "Dijkstra",
    "Allen", "Ritchie", "Perlman", "Núñez", "Brontë", "Kierkegaard", "Lamarr", "Johnson",
    "Berners-Lee", "Borg", "Knuth", "Müller",
)  # fmt: skip
_DOMAINS = ("example.com", "mail.example.org", "shop.example.net", "example.de")
_SKU_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
_COUNTRIES = ("US", "DE", "FR", "GB", "NL", "ES", "IT", "PL", "SE", "BR", "JP", "IN", "CA", "AU")

# Kafka Connect JSON schema of each Spark column type, as Debezium describes it.
_CONNECT_TYPES: dict[str, dict[str, Any]] = {
    "bigint": {"type": "int64"},
    "int": {"type": "int32"},
    "double": {"type": "double"},
    "float": {"type": "float"},
    "string": {"type": "string"},
    "boolean": {"type": "boolean"},
    "timestamp": {"type": "int64", "name": "io.debezium.time.MicroTimestamp", "version": 1},
    "date": {"type": "int32", "name": "io.debezium.time.Date", "version": 1},
}
_SOURCE_SCHEMA_FIELDS: tuple[tuple[str, str, bool], ...] = (
    ("version", "string", False),
    ("connector", "string", False),
    ("name", "string", False),
    ("ts_ms", "int64", False),
    ("snapshot", "string", True),
    ("db", "string", False),
    ("sequence", "string", True),
    ("ts_us", "int64", True),
    ("ts_ns", "int64", True),
    ("schema", "string", False),
    ("table", "string", False),
    ("txId", "int64", True),
    ("lsn", "int64", True),
    ("xmin", "int64", True),
)


@dataclass(frozen=True)
class DemoRecord:
    """One Kafka record as the connector would produce it.

    Attributes:
        table: Source table name (the `TableSpec.name`).
        topic: Kafka topic of the table.
        key: JSON primary key, UTF-8 (None never happens for this source).
        value: JSON change event, or None for a tombstone (also for a duplicated tombstone).
        timestamp_ms: Producer timestamp (CreateTime); mostly the commit time, sometimes late.
        kind: "change", "tombstone", "duplicate" (a re-sent earlier record) or "malformed".
    """

    table: str
    topic: str
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    kind: str


class _Change(NamedTuple):
    table: str
    op: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


@dataclass
class _Event:
    table: str
    key: bytes
    value: bytes | None
    timestamp_ms: int
    kind: str
    op: str | None
    lsn: int
    event_ms: int
    envelope: dict[str, Any] | None = None


class DemoSource:
    """The demo shop database and its Debezium connector, deterministic from `seed`.

    Args:
        specs: Table specs; must include customers, orders and order_items (others are
            ignored). Their columns decide what the rows and events contain.
        seed: Seed of the only random generator used.
        wrapped: Tables whose key and value carry the Kafka Connect schema/payload wrapper.
    """

    def __init__(
        self,
        specs: Iterable[TableSpec],
        *,
        seed: int = 7,
        wrapped: Iterable[str] | None = None,
    ) -> None:
        by_name = {spec.name: spec for spec in specs}
        missing = [table for table in DEMO_TABLES if table not in by_name]
        if missing:
            raise ValueError(f"the demo source needs table specs for {missing}")
        for table, natural in _NATURAL_KEYS.items():
            if set(by_name[table].primary_key) != set(natural):
                raise ValueError(
                    f"table '{table}': the demo source needs primary_key {list(natural)}, "
                    f"the spec has {list(by_name[table].primary_key)}"
                )
        self._specs = {table: by_name[table] for table in DEMO_TABLES}
        self._wrapped = frozenset(DEFAULT_WRAPPED if wrapped is None else wrapped)
        unknown = sorted(self._wrapped - set(DEMO_TABLES))
        if unknown:
            raise ValueError(f"wrapped names unknown tables {unknown}; use {list(DEMO_TABLES)}")
        self._rng = random.Random(seed)
        rng = self._rng
        self._entities: dict[str, dict[tuple, dict[str, Any]]] = {t: {} for t in DEMO_TABLES}
        self._recent: dict[str, list[tuple]] = {t: [] for t in DEMO_TABLES}
        self._next_customer_id = 1
        self._next_order_id = 1001
        self._orders_of: dict[int, int] = {}  # customer_id -> number of live orders
        self._open_orders: dict[tuple, None] = {}  # pending or paid; a dict keeps order
        self._lines: dict[int, list[int]] = {}  # order_id -> live line numbers
        self._next_line: dict[int, int] = {}
        # Realistic magnitudes; the step between changes is > 1 so malformed records can
        # take lsn + 1 without colliding with a real change.
        self._lsn = 24_000_000 + rng.randint(0, 999_999)
        self._last_commit_lsn = self._lsn
        self._tx_id = 740 + rng.randint(0, 199)
        self._origin_ms: int | None = None
        self._last_hour: datetime | None = None
        self._catalog = [
            (
                f"SKU-{''.join(rng.choices(_SKU_LETTERS, k=3))}-{rng.randint(0, 9999):04d}",
                Decimal(rng.randint(99, 49_999)).scaleb(-2),
            )
            for _ in range(40)
        ]
        self._schemas = {table: self._connect_schemas(table) for table in DEMO_TABLES}

    @property
    def specs(self) -> dict[str, TableSpec]:
        """The demo tables' specs by table name."""
        return dict(self._specs)

    @property
    def wrapped(self) -> frozenset[str]:
        """Tables emitted with the schema/payload wrapper."""
        return self._wrapped

    def generate(self, hours: Sequence[datetime], changes_per_hour: int) -> list[DemoRecord]:
        """Commits about `changes_per_hour` changes in each hour and returns the records.

        The first call starts with a snapshot (op "r") of an initial population, timestamped
        at the start of its first hour. Later calls continue from the current state and must
        ask for later hours.

        Args:
            hours: Aware datetimes on the hour, increasing, after any hour generated before.
            changes_per_hour: Target number of change events per hour (at least 1).

        Returns:
            The records in emission order (changes in LSN order, with tombstones, duplicates
            and malformed records interleaved where the connector would emit them).
        """
        if changes_per_hour < 1:
            raise ValueError(f"changes_per_hour must be at least 1, got {changes_per_hour}")
        hours = self._check_hours(hours)
        if not hours:
            return []
        events: list[_Event] = []
        if self._origin_ms is None:
            self._origin_ms = _to_ms(hours[0])
            self._snapshot(hours[0], changes_per_hour, events)
        for hour in hours:
            self._generate_hour(hour, changes_per_hour, events)
        self._last_hour = hours[-1]
        self._delay_timestamps(events)
        events = self._add_malformed(events, changes_per_hour)
        events = self._add_duplicates(events)
        return [
            DemoRecord(
                table=ev.table,
                topic=self._specs[ev.table].topic,
                key=ev.key,
                value=ev.value,
                timestamp_ms=ev.timestamp_ms,
                kind=ev.kind,
            )
            for ev in events
        ]

    def state(self, table: str) -> dict[tuple, dict[str, Any]]:
        """The table's live rows by primary-key tuple (spec order), typed as the spec says.

        Types: int for bigint/int, float for double/float, str, bool, Decimal quantized to
        the declared scale, tz-aware UTC datetime for timestamp, date for date.
        """
        if table not in self._specs:
            raise KeyError(f"unknown table '{table}'; the demo tables are {list(DEMO_TABLES)}")
        spec = self._specs[table]
        rows = (self._row(table, entity) for entity in self._entities[table].values())
        return {tuple(row[col] for col in spec.primary_key): row for row in rows}

    # -- hours and snapshot ------------------------------------------------------------------

    def _check_hours(self, hours: Sequence[datetime]) -> list[datetime]:
        checked: list[datetime] = []
        previous = self._last_hour
        for hour in hours:
            if not isinstance(hour, datetime) or hour.tzinfo is None:
                raise ValueError(f"hours must be timezone-aware datetimes, got {hour!r}")
            hour = hour.astimezone(UTC)
            if hour.minute or hour.second or hour.microsecond:
                raise ValueError(f"hour {hour.isoformat()} is not on the hour")
            if previous is not None and hour <= previous:
                raise ValueError(
                    f"hour {hour.isoformat()} is not after {previous.isoformat()}; a source "
                    "only moves forward in time"
                )
            checked.append(hour)
            previous = hour
        return checked

    def _snapshot(self, start: datetime, changes_per_hour: int, out: list[_Event]) -> None:
        rng = self._rng
        n_customers = max(2, min(20, changes_per_hour // 10))
        n_orders = max(2, min(30, changes_per_hour * 3 // 20))
        by_table: dict[str, list[_Change]] = {table: [] for table in DEMO_TABLES}
        for _ in range(n_customers):
            created = start - timedelta(microseconds=rng.randint(40 * 86_400, 400 * 86_400) * 10**6)
            by_table["customers"].append(self._new_customer_change(created))
        customers = list(self._entities["customers"])
        for _ in range(n_orders):
            ordered_at = start - timedelta(microseconds=rng.randint(60, 30 * 86_400 * 10**6))
            status = rng.choices(("pending", "paid", "shipped", "cancelled"), (3, 3, 3, 1))[0]
            ship_date = None
            if status == "shipped":
                ship_date = min(
                    start.date(), (ordered_at + timedelta(days=rng.randint(1, 3))).date()
                )
            changes = self._new_order_changes(
                rng.choice(customers), ordered_at, rng.randint(1, 3), status, ship_date
            )
            for change in changes:
                by_table[change.table].append(change)
        # Debezium snapshots one table after the other.
        changes = [c._replace(op="r") for table in DEMO_TABLES for c in by_table[table]]
        self._commit(changes, _to_ms(start), out, snapshot=True)

    def _generate_hour(self, hour: datetime, changes_per_hour: int, out: list[_Event]) -> None:
        rng = self._rng
        hour_ms = _to_ms(hour)
        self._recent = {table: [] for table in DEMO_TABLES}
        # One slot per change spreads the transactions over the whole hour; a transaction with
        # several changes uses its first slot's time and consumes the following slots.
        slots = sorted(rng.sample(range(1, _HOUR_MS), min(changes_per_hour, _HOUR_MS - 1)))
        index = 0
        while index < len(slots):
            event_ms = hour_ms + slots[index]
            now = _from_ms(event_ms) + timedelta(microseconds=rng.randint(0, 999))
            changes = self._random_transaction(now)
            self._commit(changes, event_ms, out, snapshot=False)
            index += len(changes)

    # -- the connector -----------------------------------------------------------------------

    def _commit(
        self, changes: list[_Change], event_ms: int, out: list[_Event], *, snapshot: bool
    ) -> None:
        rng = self._rng
        self._tx_id += rng.randint(1, 3)  # other transactions commit in between
        for change in changes:
            self._lsn += rng.randint(24, 480)
            spec = self._specs[change.table]
            ts_ms = event_ms + rng.randint(3, 250)  # the connector sees it a bit later
            envelope = {
                "before": self._encode_row(change.table, change.before),
                "after": self._encode_row(change.table, change.after),
                "source": {
                    "version": CONNECTOR_VERSION,
                    "connector": "postgresql",
                    "name": SERVER_NAME,
                    "ts_ms": event_ms,
                    "snapshot": "true" if snapshot else "false",
                    "db": DATABASE,
                    "sequence": json.dumps(
                        [str(self._last_commit_lsn), str(self._lsn)], separators=(",", ":")
                    ),
                    "ts_us": event_ms * 1000,
                    "ts_ns": event_ms * 1_000_000,
                    "schema": SCHEMA,
                    "table": change.table,
                    "txId": self._tx_id,
                    "lsn": self._lsn,
                    "xmin": None,
                },
                "transaction": None,
                "op": change.op,
                "ts_ms": ts_ms,
                "ts_us": ts_ms * 1000,
                "ts_ns": ts_ms * 1_000_000,
            }
            row = change.after if change.after is not None else change.before
            assert row is not None
            key = self._key_bytes(change.table, {col: row[col] for col in spec.primary_key})
            out.append(
                _Event(
                    table=change.table,
                    key=key,
                    value=self._value_bytes(change.table, envelope),
                    timestamp_ms=event_ms,
                    kind="change",
                    op=change.op,
                    lsn=self._lsn,
                    event_ms=event_ms,
                    envelope=envelope,
                )
            )
            if change.op == "d":
                out.append(
                    _Event(
                        change.table, key, None, event_ms, "tombstone", None, self._lsn, event_ms
                    )
                )
        self._last_commit_lsn = self._lsn

    def _encode_row(self, table: str, row: dict[str, Any] | None) -> dict[str, Any] | None:
        if row is None:
            return None
        columns = self._specs[table].columns
        return {col: _encode_value(columns[col], value) for col, value in row.items()}

    def _key_bytes(self, table: str, key: dict[str, Any]) -> bytes:
        payload = self._encode_row(table, key)
        if table in self._wrapped:
            return _dumps({"schema": self._schemas[table][0], "payload": payload})
        return _dumps(payload)

    def _value_bytes(self, table: str, envelope: dict[str, Any]) -> bytes:
        if table in self._wrapped:
            return _dumps({"schema": self._schemas[table][1], "payload": envelope})
        return _dumps(envelope)

    def _connect_schemas(self, table: str) -> tuple[dict[str, Any], dict[str, Any]]:
        spec = self._specs[table]
        prefix = f"{SERVER_NAME}.{SCHEMA}.{table}"

        def column(col: str) -> dict[str, Any]:
            spark_type = spec.columns[col]
            connect = _CONNECT_TYPES.get(spark_type, {"type": "string"})  # decimal as string
            return {**connect, "optional": col not in spec.primary_key, "field": col}

        key_schema = {
            "type": "struct",
            "fields": [column(col) for col in spec.primary_key],
            "optional": False,
            "name": f"{prefix}.Key",
        }
        row_fields = [column(col) for col in spec.columns]

        def row(field: str) -> dict[str, Any]:
            return {
                "type": "struct",
                "fields": row_fields,
                "optional": True,
                "name": f"{prefix}.Value",
                "field": field,
            }

        source = {
            "type": "struct",
            "fields": [
                {"type": kind, "optional": optional, "field": name}
                for name, kind, optional in _SOURCE_SCHEMA_FIELDS
            ],
            "optional": False,
            "name": "io.debezium.connector.postgresql.Source",
            "field": "source",
        }
        value_schema = {
            "type": "struct",
            "fields": [
                row("before"),
                row("after"),
                source,
                {
                    "type": "struct",
                    "fields": [
                        {"type": "string", "optional": False, "field": "id"},
                        {"type": "int64", "optional": False, "field": "total_order"},
                        {"type": "int64", "optional": False, "field": "data_collection_order"},
                    ],
                    "optional": True,
                    "name": "event.block",
                    "version": 1,
                    "field": "transaction",
                },
                {"type": "string", "optional": False, "field": "op"},
                {"type": "int64", "optional": True, "field": "ts_ms"},
                {"type": "int64", "optional": True, "field": "ts_us"},
                {"type": "int64", "optional": True, "field": "ts_ns"},
            ],
            "optional": False,
            "name": f"{prefix}.Envelope",
            "version": 2,
        }
        return key_schema, value_schema

    # -- the connector's faults --------------------------------------------------------------

    def _delay_timestamps(self, events: list[_Event]) -> None:
        rng = self._rng
        assert self._origin_ms is not None
        origin = self._origin_ms

        def delay(ev: _Event, by_ms: int) -> None:
            # Never before the first generated hour: nothing would ever read it there.
            ev.timestamp_ms = ev.event_ms - min(by_ms, ev.event_ms - origin)

        def crosses(ev: _Event) -> bool:
            return ev.timestamp_ms // _HOUR_MS < ev.event_ms // _HOUR_MS

        real = [ev for ev in events if ev.kind == "change" and ev.op != "r"]
        for ev in real:
            if rng.random() < _OUT_OF_ORDER_RATE and ev.event_ms - origin >= 60_000:
                delay(ev, rng.randint(60_000, 1_200_000))
        if not any(crosses(ev) for ev in real):
            # Make sure at least one record lands in the previous hour.
            candidates = [
                ev
                for ev in real
                if ev.event_ms % _HOUR_MS < 1_140_000
                and ev.event_ms - ev.event_ms % _HOUR_MS > origin
            ]
            if candidates:
                ev = rng.choice(candidates)
                delay(ev, rng.randint(max(60_000, ev.event_ms % _HOUR_MS + 1), 1_200_000))
        for previous, ev in zip(events, events[1:], strict=False):
            if ev.kind == "tombstone":
                ev.timestamp_ms = previous.timestamp_ms  # sent together with its delete

    def _add_malformed(self, events: list[_Event], changes_per_hour: int) -> list[_Event]:
        rng = self._rng
        extra: dict[int, list[_Event]] = {}
        for table in DEMO_TABLES:
            n_changes = sum(1 for ev in events if ev.table == table and ev.kind == "change")
            # Anchored after an insert or update, never between a delete and its tombstone.
            anchors = [
                i
                for i, ev in enumerate(events)
                if ev.table == table and ev.kind == "change" and ev.op in ("c", "u")
            ]
            count = round(n_changes * _MALFORMED_RATE)
            if changes_per_hour >= 50:
                count = max(count, len(MALFORMED_KINDS))
            count = min(count, len(anchors))
            kinds = list(MALFORMED_KINDS[:count])
            kinds += [rng.choice(MALFORMED_KINDS) for _ in range(count - len(kinds))]
            rng.shuffle(kinds)
            for index, kind in zip(sorted(rng.sample(anchors, count)), kinds, strict=True):
                extra.setdefault(index, []).append(self._malformed(events[index], kind))
        return _splice(events, extra)

    def _malformed(self, anchor: _Event, kind: str) -> _Event:
        rng = self._rng
        spec = self._specs[anchor.table]
        assert anchor.envelope is not None and anchor.envelope["after"] is not None
        envelope = copy.deepcopy(anchor.envelope)
        envelope["source"]["lsn"] = anchor.lsn + 1
        before = envelope["after"]
        after = dict(before)
        envelope["before"], envelope["after"], envelope["op"] = before, after, "u"
        non_key = [col for col in spec.columns if col not in spec.primary_key]
        if kind in ("not_json", "missing_op", "unknown_op") and non_key:
            # A plausible change: accepting it by mistake would show in the mirror.
            col = rng.choice(non_key)
            now = _from_ms(anchor.event_ms)
            after[col] = _encode_value(spec.columns[col], self._generic(spec.columns[col], now))
        if kind == "missing_op":
            del envelope["op"]
        elif kind == "unknown_op":
            envelope["op"] = "x"
        elif kind == "wrong_type":
            typed = [col for col in spec.columns if spec.columns[col] != "string"]
            candidates = [col for col in non_key if col in typed] or typed or list(spec.columns)
            col = rng.choice(candidates)
            after[col] = _wrong_value(spec.columns[col], rng)
        elif kind == "missing_pk":
            del after[rng.choice(spec.primary_key)]
        value = self._value_bytes(anchor.table, envelope)
        if kind == "not_json":
            # Either a record cut short or bytes that are not even UTF-8.
            value = rng.choice([value[: len(value) // 2], b"\xff\xfe\x00\x01not json\x80\x81"])
        return dataclasses.replace(
            anchor, value=value, kind="malformed", op=None, lsn=anchor.lsn + 1, envelope=None
        )

    def _add_duplicates(self, events: list[_Event]) -> list[_Event]:
        rng = self._rng
        extra: dict[int, list[_Event]] = {}
        for table in DEMO_TABLES:
            sent = [
                i
                for i, ev in enumerate(events)
                if ev.table == table and ev.kind in ("change", "tombstone")
            ]
            # A restart point is never between a delete and its tombstone.
            ends = [j for j in range(2, len(sent)) if events[sent[j]].op != "d"]
            if not ends:
                continue
            for j in sorted(rng.sample(ends, min(rng.randint(1, 2), len(ends)))):
                n = rng.randint(3, min(10, j + 1))
                extra.setdefault(sent[j], []).extend(
                    dataclasses.replace(events[i], kind="duplicate")
                    for i in sent[j - n + 1 : j + 1]
                )
        return _splice(events, extra)

    # -- the shop ----------------------------------------------------------------------------

    def _random_transaction(self, now: datetime) -> list[_Change]:
        actions = (
            (self._tx_new_customer, 8),
            (self._tx_update_customer, 10),
            (self._tx_delete_customer, 3),
            (self._tx_new_order, 14),
            (self._tx_advance_order, 18),
            (self._tx_add_item, 7),
            (self._tx_change_quantity, 9),
            (self._tx_remove_item, 4),
            (self._tx_delete_order, 4),
        )
        functions = [action for action, _ in actions]
        weights = [weight for _, weight in actions]
        while True:
            # An action returns None when nothing qualifies (e.g. no pending order yet);
            # a new customer always qualifies, so this ends.
            changes = self._rng.choices(functions, weights)[0](now)
            if changes:
                return changes

    def _tx_new_customer(self, now: datetime) -> list[_Change]:
        return [self._new_customer_change(now)]

    def _tx_update_customer(self, now: datetime) -> list[_Change] | None:
        rng = self._rng
        customers = self._entities["customers"]
        if not customers:
            return None
        key = self._pick("customers", list(customers))
        customer = customers[key]
        what = rng.choice(("email", "country", "active", "name"))
        fields: dict[str, Any]
        if what == "email":
            first, last = customer["full_name"].split(" ", 1)
            fields = {"email": _email(first, last, rng.randint(1, 9999), rng.choice(_DOMAINS))}
        elif what == "country":
            fields = {"country": rng.choice([c for c in _COUNTRIES if c != customer["country"]])}
        elif what == "active":
            fields = {"is_active": not customer["is_active"]}
        else:
            first = customer["full_name"].split(" ", 1)[0]
            fields = {"full_name": f"{first} {rng.choice(_LAST_NAMES)}"}
        return [self._update("customers", key, fields)]

    def _tx_delete_customer(self, now: datetime) -> list[_Change] | None:
        candidates = [key for key in self._entities["customers"] if not self._orders_of.get(key[0])]
        if not candidates:
            return None
        return [self._delete("customers", self._rng.choice(candidates))]

    def _tx_new_order(self, now: datetime) -> list[_Change] | None:
        customers = self._entities["customers"]
        active = [key for key, customer in customers.items() if customer["is_active"]]
        if not active:
            return None
        customer = self._pick("customers", active)
        return self._new_order_changes(customer, now, self._rng.randint(1, 4), "pending", None)

    def _tx_advance_order(self, now: datetime) -> list[_Change] | None:
        rng = self._rng
        if not self._open_orders:
            return None
        key = self._pick("orders", list(self._open_orders))
        status = self._entities["orders"][key]["status"]
        fields: dict[str, Any]
        if status == "pending":
            fields = {"status": "paid" if rng.random() < 0.85 else "cancelled"}
        elif rng.random() < 0.9:
            fields = {"status": "shipped", "ship_date": now.date()}
        else:
            fields = {"status": "cancelled"}
        if fields["status"] in ("shipped", "cancelled"):
            del self._open_orders[key]
        return [self._update("orders", key, fields)]

    def _tx_add_item(self, now: datetime) -> list[_Change] | None:
        candidates = [
            key for key in self._pending_orders() if len(self._lines[key[0]]) < _MAX_LINES
        ]
        if not candidates:
            return None
        order_key = self._pick("orders", candidates)
        return [self._new_item_change(order_key[0], now), self._retotal(order_key)]

    def _tx_change_quantity(self, now: datetime) -> list[_Change] | None:
        rng = self._rng
        items = [(key[0], line) for key in self._pending_orders() for line in self._lines[key[0]]]
        if not items:
            return None
        item_key = self._pick("order_items", items)
        old = self._entities["order_items"][item_key]["quantity"]
        quantity = rng.choice([q for q in range(1, 11) if q != old])
        change = self._update("order_items", item_key, {"quantity": quantity})
        return [change, self._retotal((item_key[0],))]

    def _tx_remove_item(self, now: datetime) -> list[_Change] | None:
        candidates = [key for key in self._pending_orders() if len(self._lines[key[0]]) > 1]
        if not candidates:
            return None
        order_key = self._pick("orders", candidates)
        line = self._rng.choice(self._lines[order_key[0]])
        self._lines[order_key[0]].remove(line)
        return [self._delete("order_items", (order_key[0], line)), self._retotal(order_key)]

    def _tx_delete_order(self, now: datetime) -> list[_Change] | None:
        rng = self._rng
        orders = self._entities["orders"]
        if not orders:
            return None
        cancelled = [key for key, order in orders.items() if order["status"] == "cancelled"]
        key = rng.choice(cancelled if cancelled and rng.random() < 0.7 else list(orders))
        order_id = key[0]
        changes = [self._delete("order_items", (order_id, line)) for line in self._lines[order_id]]
        customer_id = orders[key]["customer_id"]
        changes.append(self._delete("orders", key))
        self._orders_of[customer_id] -= 1
        self._open_orders.pop(key, None)
        del self._lines[order_id], self._next_line[order_id]
        return changes

    def _new_customer_change(self, created_at: datetime) -> _Change:
        rng = self._rng
        customer_id = self._next_customer_id
        self._next_customer_id += 1
        first, last = rng.choice(_FIRST_NAMES), rng.choice(_LAST_NAMES)
        entity = {
            "customer_id": customer_id,
            "email": _email(first, last, customer_id, rng.choice(_DOMAINS)),
            "full_name": f"{first} {last}",
            "country": rng.choice(_COUNTRIES),
            "is_active": rng.random() < 0.95,
            "created_at": created_at,
        }
        return self._insert("customers", entity, created_at)

    def _new_order_changes(
        self,
        customer_key: tuple,
        ordered_at: datetime,
        n_items: int,
        status: str,
        ship_date: date | None,
    ) -> list[_Change]:
        order_id = self._next_order_id
        self._next_order_id += 1
        self._lines[order_id] = []
        self._next_line[order_id] = 1
        items = [self._new_item_change(order_id, ordered_at) for _ in range(n_items)]
        entity = {
            "order_id": order_id,
            "customer_id": customer_key[0],
            "status": status,
            "total": self._total(order_id),
            "ordered_at": ordered_at,
            "ship_date": ship_date,
        }
        self._orders_of[customer_key[0]] = self._orders_of.get(customer_key[0], 0) + 1
        if status in ("pending", "paid"):
            self._open_orders[(order_id,)] = None
        # The order row is written before its lines, as the foreign key requires.
        return [self._insert("orders", entity, ordered_at), *items]

    def _new_item_change(self, order_id: int, now: datetime) -> _Change:
        rng = self._rng
        line = self._next_line[order_id]
        self._next_line[order_id] += 1
        self._lines[order_id].append(line)
        sku, price = rng.choice(self._catalog)
        entity = {
            "order_id": order_id,
            "line_no": line,
            "sku": sku,
            "quantity": rng.randint(1, 10),
            "unit_price": price,
        }
        return self._insert("order_items", entity, now)

    def _pending_orders(self) -> list[tuple]:
        orders = self._entities["orders"]
        return [key for key in self._open_orders if orders[key]["status"] == "pending"]

    def _total(self, order_id: int) -> Decimal:
        items = self._entities["order_items"]
        total = sum(
            (
                items[(order_id, line)]["quantity"] * items[(order_id, line)]["unit_price"]
                for line in self._lines[order_id]
            ),
            Decimal(0),
        )
        return total.quantize(Decimal("0.01"))

    def _retotal(self, order_key: tuple) -> _Change:
        return self._update("orders", order_key, {"total": self._total(order_key[0])})

    def _pick(self, table: str, candidates: list[tuple]) -> tuple:
        """Picks a key, often one already changed this hour (several updates per key)."""
        rng = self._rng
        allowed = set(candidates)
        hot = [key for key in self._recent[table] if key in allowed]
        if hot and rng.random() < _HOT_KEY_RATE:
            return rng.choice(hot)
        return rng.choice(candidates)

    # -- rows --------------------------------------------------------------------------------

    def _insert(self, table: str, entity: dict[str, Any], now: datetime) -> _Change:
        for col, spark_type in self._specs[table].columns.items():
            # Columns the shop does not know about (added to the spec) get plausible values.
            if col not in entity:
                entity[col] = self._generic(spark_type, now)
        key = tuple(entity[col] for col in _NATURAL_KEYS[table])
        self._entities[table][key] = entity
        self._recent[table].append(key)
        return _Change(table, "c", None, self._row(table, entity))

    def _update(self, table: str, key: tuple, fields: dict[str, Any]) -> _Change:
        entity = self._entities[table][key]
        before = self._row(table, entity)
        entity.update(fields)
        self._recent[table].append(key)
        return _Change(table, "u", before, self._row(table, entity))

    def _delete(self, table: str, key: tuple) -> _Change:
        entity = self._entities[table].pop(key)
        return _Change(table, "d", self._row(table, entity), None)

    def _row(self, table: str, entity: dict[str, Any]) -> dict[str, Any]:
        columns = self._specs[table].columns
        return {col: _coerce(entity[col], spark_type) for col, spark_type in columns.items()}

    def _generic(self, spark_type: str, now: datetime) -> Any:
        rng = self._rng
        if spark_type == "bigint":
            return rng.randint(1, 10**9)
        if spark_type == "int":
            return rng.randint(1, 10_000)
        if spark_type in ("double", "float"):
            return rng.randint(0, 40_000) / 4  # exact in float32 too
        if spark_type == "boolean":
            return rng.random() < 0.5
        if spark_type == "timestamp":
            return now - timedelta(microseconds=rng.randint(0, 86_400 * 10**6))
        if spark_type == "date":
            return now.date() - timedelta(days=rng.randint(0, 30))
        match = _DECIMAL_TYPE.match(spark_type)
        if match:
            precision, scale = int(match[1]), int(match[2])
            return Decimal(rng.randint(0, 10 ** min(precision, 9) - 1)).scaleb(-scale)
        return f"v-{rng.randint(0, 99_999)}"


def _splice(events: list[_Event], extra: dict[int, list[_Event]]) -> list[_Event]:
    """Inserts `extra[i]` right after `events[i]`."""
    out: list[_Event] = []
    for index, ev in enumerate(events):
        out.append(ev)
        out.extend(extra.get(index, ()))
    return out


def _coerce(value: Any, spark_type: str) -> Any:
    """Converts a shop value to the Python type that stands for `spark_type`."""
    if value is None:
        return None
    if spark_type in ("bigint", "int"):
        return int(value)
    if spark_type in ("double", "float"):
        return float(value)
    if spark_type == "boolean":
        return bool(value)
    if spark_type == "string":
        return str(value)
    if spark_type == "timestamp":
        if not isinstance(value, datetime):
            value = datetime.combine(value, datetime.min.time())
        return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    if spark_type == "date":
        return value.date() if isinstance(value, datetime) else value
    match = _DECIMAL_TYPE.match(spark_type)
    if match:
        return Decimal(value).quantize(Decimal(1).scaleb(-int(match[2])), ROUND_HALF_UP)
    raise ValueError(f"unsupported column type '{spark_type}'")


def _encode_value(spark_type: str, value: Any) -> Any:
    """Debezium's JSON encoding of a column value (adaptive time, decimals as strings)."""
    if value is None:
        return None
    if spark_type == "timestamp":
        return (value - _EPOCH) // timedelta(microseconds=1)
    if spark_type == "date":
        return (value - _EPOCH_DATE).days
    if spark_type.startswith("decimal"):
        return format(value, "f")
    return value


def _wrong_value(spark_type: str, rng: random.Random) -> Any:
    """A JSON value that a column of `spark_type` cannot hold."""
    if spark_type in ("bigint", "int"):
        return rng.choice(("not-a-number", "yes"))
    if spark_type == "boolean":
        return "yes"
    if spark_type == "timestamp":
        return "not-a-timestamp"
    if spark_type == "date":
        return "not-a-date"
    if spark_type == "string":
        return 12345
    return "not-a-number"  # double, float, decimal


def _email(first: str, last: str, number: int, domain: str) -> str:
    local = f"{first}.{last}".replace(" ", "").replace("-", "")
    local = unicodedata.normalize("NFKD", local).encode("ascii", "ignore").decode().lower()
    return f"{local}{number}@{domain}"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _to_ms(moment: datetime) -> int:
    return (moment - _EPOCH) // timedelta(milliseconds=1)


def _from_ms(ms: int) -> datetime:
    return _EPOCH + timedelta(milliseconds=ms)
