"""The demo source's events and the reference replay, checked against each other (no Kafka)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
from collections import Counter, defaultdict
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from cdc_assets.config import TableSpec, load_tables
from demo.reference import replay, replay_with_errors
from demo.source import DEMO_TABLES, DemoRecord, DemoSource, as_generated

REPO = Path(__file__).resolve().parents[2]
SPECS = {spec.name: spec for spec in as_generated(load_tables())}
HOURS = [datetime(2026, 11, 1, 0, tzinfo=UTC) + timedelta(hours=n) for n in range(4)]
HOUR_MS = 3_600_000
ERROR_CATEGORIES = ("invalid json", "missing op", "unknown op", "wrong type", "missing primary key")


@pytest.fixture(scope="module")
def source() -> DemoSource:
    return DemoSource(SPECS.values(), seed=7)


@pytest.fixture(scope="module")
def records(source: DemoSource) -> list[DemoRecord]:
    return source.generate(HOURS, 200)


def _envelope(value: bytes) -> dict[str, Any]:
    document = json.loads(value)
    return document["payload"] if "payload" in document else document


def _changes(records: list[DemoRecord], table: str | None = None) -> list[DemoRecord]:
    return [r for r in records if r.kind == "change" and table in (None, r.table)]


def _one_partition(records: list[DemoRecord], table: str) -> list[tuple[int, int, bytes | None]]:
    """The table's records as Kafka would return them from a one-partition topic."""
    return [(0, offset, r.value) for offset, r in enumerate(r for r in records if r.table == table)]


def _partitioned(
    records: list[DemoRecord], table: str, partitions: int
) -> list[tuple[int, int, bytes | None]]:
    """As from a topic with several partitions: one key, one partition; offsets per partition."""
    next_offset: Counter[int] = Counter()
    out = []
    for record in records:
        if record.table == table:
            assert record.key is not None
            partition = int(hashlib.sha256(record.key).hexdigest(), 16) % partitions
            out.append((partition, next_offset[partition], record.value))
            next_offset[partition] += 1
    return out


def _digest(records: list[DemoRecord]) -> str:
    digest = hashlib.sha256()
    for r in records:
        digest.update(repr((r.table, r.topic, r.key, r.value, r.timestamp_ms, r.kind)).encode())
    return digest.hexdigest()


# -- determinism --------------------------------------------------------------------------------


def test_same_seed_gives_identical_records(records: list[DemoRecord]) -> None:
    again = DemoSource(SPECS.values(), seed=7).generate(HOURS, 200)
    other = DemoSource(SPECS.values(), seed=8).generate(HOURS, 200)

    assert again == records
    assert other != records


def test_records_do_not_depend_on_hash_randomization(records: list[DemoRecord]) -> None:
    code = (
        "import hashlib\n"
        "from datetime import UTC, datetime, timedelta\n"
        "from cdc_assets.config import load_tables\n"
        "from demo.source import DemoSource\n"
        "hours = [datetime(2026, 11, 1, tzinfo=UTC) + timedelta(hours=n) for n in range(4)]\n"
        "records = DemoSource(load_tables(), seed=7).generate(hours, 200)\n"
        "digest = hashlib.sha256()\n"
        "for r in records:\n"
        "    digest.update(repr((r.table, r.topic, r.key, r.value, r.timestamp_ms, r.kind))"
        ".encode())\n"
        "print(digest.hexdigest())\n"
    )
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        digests.add(result.stdout.strip())

    assert digests == {_digest(records)}


# -- the events ---------------------------------------------------------------------------------


@pytest.mark.parametrize("table", DEMO_TABLES)
def test_every_op_occurs_in_every_table(records: list[DemoRecord], table: str) -> None:
    assert records[0].kind == "change"
    ops = Counter(_envelope(r.value)["op"] for r in _changes(records, table) if r.value)

    assert set(ops) == {"r", "c", "u", "d"}


def test_envelope_shape(records: list[DemoRecord]) -> None:
    for record in _changes(records):
        assert record.value is not None and record.key is not None
        document = json.loads(record.value)
        wrapped = record.table == "orders"
        assert ("schema" in document and "payload" in document) == wrapped
        envelope = _envelope(record.value)
        source = envelope["source"]
        assert source["connector"] == "postgresql" and source["version"] == "2.7.0.Final"
        assert (source["name"], source["db"], source["schema"]) == ("demo", "shop", "public")
        assert source["table"] == record.table
        assert source["snapshot"] == ("true" if envelope["op"] == "r" else "false")
        assert envelope["ts_ms"] > source["ts_ms"]
        assert record.timestamp_ms <= source["ts_ms"]
        row = envelope["before"] if envelope["op"] == "d" else envelope["after"]
        assert list(row) == list(SPECS[record.table].columns)
        key = json.loads(record.key)
        key = key["payload"] if wrapped else key
        assert key == {col: row[col] for col in SPECS[record.table].primary_key}
        if envelope["op"] in ("r", "c"):
            assert envelope["before"] is None
        if envelope["op"] == "u":
            assert envelope["before"] is not None and envelope["after"] is not None
        if envelope["op"] == "d":
            assert envelope["after"] is None


def test_wrapped_schema_names_debezium_types(records: list[DemoRecord]) -> None:
    order = next(r for r in _changes(records, "orders"))
    assert order.value is not None and order.key is not None
    schema = json.loads(order.value)["schema"]
    after = next(field for field in schema["fields"] if field["field"] == "after")
    columns = {field["field"]: field for field in after["fields"]}

    assert columns["order_id"]["type"] == "int64" and not columns["order_id"]["optional"]
    assert columns["total"]["type"] == "string"
    assert columns["ordered_at"]["name"] == "io.debezium.time.MicroTimestamp"
    assert (columns["ship_date"]["type"], columns["ship_date"]["name"]) == (
        "int32",
        "io.debezium.time.Date",
    )
    assert json.loads(order.key)["schema"]["fields"][0]["field"] == "order_id"


def test_lsn_is_one_strictly_increasing_counter(records: list[DemoRecord]) -> None:
    lsns = [_envelope(r.value)["source"]["lsn"] for r in _changes(records) if r.value]

    assert all(a < b for a, b in zip(lsns, lsns[1:], strict=False))
    # Changes of a transaction share the commit time but not the LSN.
    assert len({_envelope(r.value)["source"]["txId"] for r in _changes(records) if r.value}) < len(
        lsns
    )


def test_tombstone_follows_every_delete(records: list[DemoRecord]) -> None:
    deletes = 0
    for index, record in enumerate(records):
        if record.kind == "change" and record.value and _envelope(record.value)["op"] == "d":
            deletes += 1
            tombstone = records[index + 1]
            assert tombstone.kind == "tombstone" and tombstone.value is None
            assert (tombstone.topic, tombstone.key) == (record.topic, record.key)
        if record.kind == "tombstone":
            assert records[index - 1].value is not None
            assert _envelope(records[index - 1].value)["op"] == "d"

    assert deletes == sum(1 for r in records if r.kind == "tombstone") > 0


@pytest.mark.parametrize("table", DEMO_TABLES)
def test_restart_duplicates_repeat_the_previous_records(
    records: list[DemoRecord], table: str
) -> None:
    runs: list[tuple[int, int]] = []  # (start, length) of consecutive duplicates
    for index, record in enumerate(records):
        if record.table == table and record.kind == "duplicate":
            previous = records[index - 1]
            if runs and previous.table == table and previous.kind == "duplicate":
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((index, 1))

    assert 1 <= len(runs) <= 2
    for start, length in runs:
        assert 3 <= length <= 10
        sent = [
            r for r in records[:start] if r.table == table and r.kind in ("change", "tombstone")
        ]
        originals = sent[-length:]
        copies = records[start : start + length]
        assert [(r.key, r.value, r.timestamp_ms) for r in copies] == [
            (r.key, r.value, r.timestamp_ms) for r in originals
        ]


@pytest.mark.parametrize("table", DEMO_TABLES)
def test_several_updates_hit_one_key_within_an_hour(records: list[DemoRecord], table: str) -> None:
    updates: Counter[tuple[bytes | None, int]] = Counter()
    for record in _changes(records, table):
        envelope = _envelope(record.value or b"")
        if envelope["op"] == "u":
            updates[(record.key, envelope["source"]["ts_ms"] // HOUR_MS)] += 1

    assert max(updates.values()) >= 3


def test_some_producer_timestamps_are_late(records: list[DemoRecord]) -> None:
    real = [r for r in _changes(records) if r.value and _envelope(r.value)["op"] != "r"]
    late = [r for r in real if r.timestamp_ms < _envelope(r.value or b"")["source"]["ts_ms"]]
    previous_hour = [
        r
        for r in late
        if r.timestamp_ms // HOUR_MS < _envelope(r.value or b"")["source"]["ts_ms"] // HOUR_MS
    ]

    assert 0.02 * len(real) <= len(late) <= 0.1 * len(real)
    assert previous_hour
    for record in late:
        delay = _envelope(record.value or b"")["source"]["ts_ms"] - record.timestamp_ms
        assert 60_000 <= delay <= 1_200_000
    assert min(r.timestamp_ms for r in records) == int(HOURS[0].timestamp() * 1000)
    for table in DEMO_TABLES:
        stamps = [r.timestamp_ms for r in records if r.table == table]
        assert stamps != sorted(stamps)


@pytest.mark.parametrize("table", DEMO_TABLES)
def test_malformed_records_are_exactly_the_replay_errors(
    records: list[DemoRecord], table: str
) -> None:
    mine = [r for r in records if r.table == table]
    malformed = {offset for offset, r in enumerate(mine) if r.kind == "malformed"}

    _, errors = replay_with_errors(SPECS[table], _one_partition(records, table))

    assert {offset for _, offset, _ in errors} == malformed
    categories = Counter(
        next(c for c in ERROR_CATEGORIES if reason.startswith(c)) for _, _, reason in errors
    )
    assert set(categories) == set(ERROR_CATEGORIES)
    changes = sum(1 for r in mine if r.kind == "change")
    assert len(malformed) <= max(len(ERROR_CATEGORIES), round(changes * 0.02))


def test_malformed_records_never_reuse_a_change_lsn(records: list[DemoRecord]) -> None:
    lsns = {_envelope(r.value)["source"]["lsn"] for r in _changes(records) if r.value}
    for record in records:
        if record.kind == "malformed" and record.value:
            try:
                envelope = _envelope(record.value)
            except ValueError:
                continue
            assert envelope["source"]["lsn"] not in lsns


# -- the state and the replay -------------------------------------------------------------------


@pytest.mark.parametrize("table", DEMO_TABLES)
def test_replay_equals_source_state(
    source: DemoSource, records: list[DemoRecord], table: str
) -> None:
    expected = source.state(table)

    assert len(expected) > 10
    assert replay(SPECS[table], _one_partition(records, table)) == expected
    assert replay(SPECS[table], _partitioned(records, table, 3)) == expected


@pytest.mark.parametrize("table", DEMO_TABLES)
def test_replay_does_not_depend_on_read_order(
    source: DemoSource, records: list[DemoRecord], table: str
) -> None:
    shuffled = _partitioned(records, table, 3)
    random.Random(1).shuffle(shuffled)

    assert replay(SPECS[table], shuffled) == source.state(table)


@pytest.mark.parametrize("table", DEMO_TABLES)
def test_replay_differs_when_the_last_delete_is_lost(
    source: DemoSource, records: list[DemoRecord], table: str
) -> None:
    last_delete = max(
        index
        for index, r in enumerate(records)
        if r.table == table and r.kind == "change" and _envelope(r.value or b"")["op"] == "d"
    )
    damaged = records[:last_delete] + records[last_delete + 1 :]

    replayed = replay(SPECS[table], _one_partition(damaged, table))

    assert replayed != source.state(table)
    assert len(replayed) == len(source.state(table)) + 1


def test_replay_differs_when_two_updates_swap_lsns(
    source: DemoSource, records: list[DemoRecord]
) -> None:
    # A live key whose last two events are distinct updates, not re-sent by a restart.
    by_key: defaultdict[bytes | None, list[int]] = defaultdict(list)
    for index, record in enumerate(records):
        if record.table == "customers" and record.kind in ("change", "duplicate"):
            by_key[record.key].append(index)
    live_keys = {
        json.dumps({"customer_id": key[0]}, separators=(",", ":")).encode()
        for key in source.state("customers")
    }

    def swappable(indexes: list[int]) -> bool:
        last = [_envelope(records[i].value or b"") for i in indexes[-2:]]
        return (
            len(indexes) >= 2
            and all(records[i].kind == "change" for i in indexes)
            and all(envelope["op"] == "u" for envelope in last)
            and last[0]["after"] != last[1]["after"]
        )

    first, second = next(
        indexes[-2:] for key, indexes in by_key.items() if key in live_keys and swappable(indexes)
    )
    a, b = _envelope(records[first].value or b""), _envelope(records[second].value or b"")
    a["source"]["lsn"], b["source"]["lsn"] = b["source"]["lsn"], a["source"]["lsn"]
    damaged = list(records)
    damaged[first] = dataclasses.replace(records[first], value=json.dumps(a).encode())
    damaged[second] = dataclasses.replace(records[second], value=json.dumps(b).encode())

    replayed = replay(SPECS["customers"], _one_partition(damaged, "customers"))

    assert replayed != source.state("customers")


@pytest.mark.parametrize("table", DEMO_TABLES)
def test_state_values_are_typed_per_spec(source: DemoSource, table: str) -> None:
    spec = SPECS[table]
    rows = source.state(table)
    for key, row in rows.items():
        assert key == tuple(row[col] for col in spec.primary_key)
        assert list(row) == list(spec.columns)
        for col, value in row.items():
            if value is None:
                assert col not in spec.primary_key
                continue
            _assert_typed(spec, col, value)


def _assert_typed(spec: TableSpec, col: str, value: Any) -> None:
    spark_type = spec.columns[col]
    if spark_type in ("bigint", "int"):
        assert type(value) is int
    elif spark_type == "string":
        assert type(value) is str
    elif spark_type == "boolean":
        assert type(value) is bool
    elif spark_type == "timestamp":
        assert type(value) is datetime and value.utcoffset() == timedelta(0)
    elif spark_type == "date":
        assert type(value) is date
    else:
        precision, scale = (int(n) for n in spark_type[8:-1].split(","))
        assert type(value) is Decimal and value.as_tuple().exponent == -scale
        assert abs(value) < Decimal(10) ** (precision - scale)


def test_business_values_are_realistic(source: DemoSource) -> None:
    customers = source.state("customers")
    orders = source.state("orders")
    items = source.state("order_items")

    assert all("@" in row["email"] and len(row["country"]) == 2 for row in customers.values())
    assert {row["status"] for row in orders.values()} <= {"pending", "paid", "shipped", "cancelled"}
    assert all(1 <= row["quantity"] <= 10 for row in items.values())
    assert all((row["customer_id"],) in customers for row in orders.values())
    assert all((row["order_id"],) in orders for row in items.values())
    for (order_id,), order in orders.items():
        lines = [row for (oid, _), row in items.items() if oid == order_id]
        assert order["total"] == sum(r["quantity"] * r["unit_price"] for r in lines)


# -- configuration and continuation -------------------------------------------------------------


def test_wrapped_tables_are_configurable() -> None:
    source = DemoSource(SPECS.values(), seed=3, wrapped={"customers", "order_items"})
    records = source.generate(HOURS[:2], 80)

    for record in _changes(records):
        assert record.value is not None
        assert ("payload" in json.loads(record.value)) == (record.table != "orders")
    for table in DEMO_TABLES:
        assert replay(SPECS[table], _one_partition(records, table)) == source.state(table)
    with pytest.raises(ValueError, match="unknown tables"):
        DemoSource(SPECS.values(), wrapped={"invoices"})


def test_generate_continues_from_its_state() -> None:
    source = DemoSource(SPECS.values(), seed=11)
    first = source.generate(HOURS[:2], 60)
    second = source.generate(HOURS[2:], 60)

    assert not [r for r in _changes(second) if _envelope(r.value or b"")["op"] == "r"]
    lsns = [_envelope(r.value or b"")["source"]["lsn"] for r in _changes(first + second)]
    assert all(a < b for a, b in zip(lsns, lsns[1:], strict=False))
    for table in DEMO_TABLES:
        assert replay(SPECS[table], _one_partition(first + second, table)) == source.state(table)
    with pytest.raises(ValueError, match="not after"):
        source.generate(HOURS[3:], 60)
    with pytest.raises(ValueError, match="timezone-aware"):
        source.generate([datetime(2026, 12, 1)], 60)
    with pytest.raises(ValueError, match="on the hour"):
        source.generate([datetime(2026, 12, 1, 0, 30, tzinfo=UTC)], 60)


def test_few_changes_per_hour_still_replays() -> None:
    source = DemoSource(SPECS.values(), seed=5)
    records = source.generate(HOURS[:3], 5)

    assert sum(1 for r in records if r.kind == "change" and r.value) >= 15
    for table in DEMO_TABLES:
        assert replay(SPECS[table], _one_partition(records, table)) == source.state(table)


def test_source_requires_the_demo_tables() -> None:
    with pytest.raises(ValueError, match="order_items"):
        DemoSource([SPECS["customers"], SPECS["orders"]])


# -- the reference on hand-written events -------------------------------------------------------


def _event(op: str, lsn: int, before: dict | None, after: dict | None) -> bytes:
    return json.dumps(
        {"before": before, "after": after, "source": {"lsn": lsn}, "op": op, "ts_ms": 0}
    ).encode()


ITEM = {"order_id": 1, "line_no": 1, "sku": "SKU-A", "quantity": 2, "unit_price": "3.5"}


def test_reference_converts_and_orders_by_sequence() -> None:
    spec = SPECS["order_items"]
    newer = {**ITEM, "quantity": 5}
    records = [
        (0, 0, _event("u", 20, ITEM, newer)),
        (0, 1, _event("c", 10, None, ITEM)),  # older by LSN, read later: ignored
        (0, 2, None),
    ]

    state = replay(spec, records)

    assert state == {
        (1, 1): {**newer, "unit_price": Decimal("3.50")},
    }


def test_reference_delete_is_not_undone_by_an_older_change() -> None:
    spec = SPECS["order_items"]
    records = [(1, 7, _event("d", 30, ITEM, None)), (0, 3, _event("u", 20, ITEM, ITEM))]

    assert replay(spec, records) == {}


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"\xff{", "invalid json"),
        (b"[1, 2]", "invalid json"),
        (json.dumps({"after": ITEM, "source": {"lsn": 1}}).encode(), "missing op"),
        (_event("t", 1, None, None), "unknown op"),
        (_event("c", 1, None, {**ITEM, "quantity": True}), "wrong type"),
        (_event("c", 1, None, {**ITEM, "quantity": 2**31}), "wrong type"),
        (_event("c", 1, None, {**ITEM, "unit_price": "123456789.00"}), "wrong type"),
        (_event("c", 1, None, {**ITEM, "line_no": None}), "missing primary key"),
        (_event("d", 1, None, None), "missing primary key"),  # no before-image, no Kafka key
        (json.dumps({"after": ITEM, "op": "c"}).encode(), "missing sequence"),
    ],
)
def test_reference_rejects_malformed_values(value: bytes, reason: str) -> None:
    state, errors = replay_with_errors(SPECS["order_items"], [(2, 9, value)])

    assert state == {}
    assert len(errors) == 1 and errors[0][:2] == (2, 9) and errors[0][2].startswith(reason)


def test_reference_reads_the_timestamp_unit_from_the_wrapper_schema() -> None:
    spec = SPECS["customers"]
    row = {
        "customer_id": 1,
        "email": "a@example.com",
        "full_name": "A B",
        "country": "DE",
        "is_active": True,
        "created_at": 1_700_000_000_123,
        "bio": "",
    }
    schema = {
        "type": "struct",
        "fields": [
            {
                "type": "struct",
                "field": "after",
                "fields": [
                    {"type": "int64", "name": "io.debezium.time.Timestamp", "field": "created_at"}
                ],
            }
        ],
    }
    payload = {"before": None, "after": row, "source": {"lsn": 5}, "op": "c"}
    wrapped = json.dumps({"schema": schema, "payload": payload}).encode()

    state = replay(spec, [(0, 0, wrapped), (0, 1, _event("c", 4, None, row))])

    created = state[(1,)]["created_at"]
    assert created == datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)
