"""The record decoder on Kafka rows built by hand: envelopes with and without their Connect
schema, keys, headers and what the batch reports of the source's columns. Pure: no Spark."""

from __future__ import annotations

import base64
import json
from decimal import Decimal

import pyarrow as pa

from cdc_assets.columns import ERROR, MOVED_FROM, SHAPE, has_value
from cdc_assets.config import TableSpec
from cdc_assets.decoding.batch import decode_batch
from cdc_assets.decoding.exact import RecordDecoder
from cdc_assets.decoding.plan import DecodePlan
from cdc_assets.decoding.shape import SourceShape, added_column_types

SPEC = TableSpec(
    name="accounts",
    topic="t",
    primary_key=("id",),
    columns={"id": "bigint", "balance": "decimal(14,2)", "note": "string"},
    toasted_columns=("note",),
    start_hour="2026-11-01-00:00",
)
ROW_SCHEMA = {
    "type": "struct",
    "optional": True,
    "fields": [
        {"type": "int64", "optional": False, "field": "id"},
        {
            "type": "bytes",
            "optional": True,
            "name": "org.apache.kafka.connect.data.Decimal",
            "version": 1,
            "parameters": {"scale": "2", "connect.decimal.precision": "14"},
            "field": "balance",
        },
        {"type": "string", "optional": True, "field": "note"},
    ],
}


def _schema(row_schema: dict) -> dict:
    return {
        "type": "struct",
        "fields": [
            {**row_schema, "field": "before"},
            {**row_schema, "field": "after"},
            {"type": "string", "optional": False, "field": "op"},
        ],
    }


def _value(op: str, row: dict | None, lsn: int, *, schema: dict | None = None) -> bytes:
    envelope = {
        "before": row if op == "d" else None,
        "after": None if op == "d" else row,
        "source": {"lsn": lsn, "ts_ms": 1_793_491_657_373},
        "op": op,
        "ts_ms": 1,
    }
    document = envelope if schema is None else {"schema": schema, "payload": envelope}
    return json.dumps(document, separators=(",", ":")).encode()


def _b64(unscaled: int) -> str:
    size = max(1, (unscaled.bit_length() + 8) // 8)
    return base64.b64encode(unscaled.to_bytes(size, "big", signed=True)).decode()


def _decode(records: list[tuple], spec: TableSpec = SPEC, *, fast=True, **plan) -> list[dict]:
    """records: (key, value[, headers]) → decoded rows as dicts (`fast=False`: the exact pass
    alone)."""
    decoder = RecordDecoder(DecodePlan.of(spec, hour_key="2026-11-02-06:00", **plan))
    batch = pa.RecordBatch.from_pydict(
        {
            "key": [r[0] for r in records],
            "value": [r[1] for r in records],
            "topic": ["t"] * len(records),
            "partition": [0] * len(records),
            "offset": list(range(len(records))),
            "timestamp": pa.array([0] * len(records), pa.timestamp("us", tz="UTC")),
            "headers": pa.array(
                [r[2] if len(r) > 2 else None for r in records],
                pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())])),
            ),
        }
    )
    return decode_batch(decoder, batch, fast=fast).to_pylist()


def test_a_schema_decides_each_records_encoding_and_a_changed_schema_is_followed():
    wrapped = _schema(ROW_SCHEMA)
    # The same table after `ALTER TABLE ... ALTER COLUMN balance TYPE numeric(14,3)`.
    scale_3 = json.loads(json.dumps(ROW_SCHEMA))
    scale_3["fields"][1]["parameters"]["scale"] = "3"
    values = [("76e4", wrapped), (_b64(1), wrapped), (_b64(1230), _schema(scale_3))]
    values.append((_b64(1234), _schema(scale_3)))
    rows = _decode(
        [
            (b'{"id":%d}' % n, _value("c", {"id": n, "balance": b, "note": None}, n, schema=s))
            for n, (b, s) in enumerate(values, start=1)
        ]
    )
    assert [r["balance"] for r in rows] == [
        Decimal("-10711.76"),
        Decimal("0.01"),
        Decimal("1.23"),
        None,
    ]
    assert "more than 2 decimal places" in rows[3][ERROR]
    shape = SourceShape.combine(r[SHAPE] for r in rows)
    assert shape.fields["balance"] == {"bytes/Decimal(scale=2)", "bytes/Decimal(scale=3)"}
    assert shape.schemas == {True}


def test_without_a_schema_the_tables_config_decides():
    rows = _decode([(b'{"id":1}', _value("c", {"id": 1, "balance": "12.30", "note": "x"}, 10))])
    assert "declare decimal_handling: string" in rows[0][ERROR]
    text = SPEC.model_copy(update={"decimal_handling": "string"})
    rows = _decode(
        [(b'{"id":1}', _value("c", {"id": 1, "balance": "12.30", "note": "x"}, 10))], text
    )
    assert rows[0][ERROR] is None and rows[0]["balance"] == Decimal("12.30")
    shape = SourceShape.combine(r[SHAPE] for r in rows)
    assert shape.fields["balance"] == {"json:string"} and shape.schemas == {False}


def test_without_a_schema_one_bad_value_is_an_error_row_and_a_changed_kind_is_drift():
    text = SPEC.model_copy(update={"decimal_handling": "string"})

    def changes(balances: list) -> list[tuple]:
        return [
            (b'{"id":%d}' % n, _value("c", {"id": n, "balance": b, "note": "x"}, n))
            for n, b in enumerate(balances, start=1)
        ]

    rows = _decode(changes(["1.00", 7, "2.50"]), text)
    assert [r[ERROR] is None for r in rows] == [True, False, True]
    assert SourceShape.combine(r[SHAPE] for r in rows).drifted() == {}
    # The connector now sends numbers (decimal.handling.mode=double): drift, and every change
    # since an error naming the fix.
    rows = _decode(changes(["1.00", 1.0, 7, 2.5]), text)
    assert [r[ERROR] is None for r in rows] == [True, False, False, False]
    drifted = SourceShape.combine(r[SHAPE] for r in rows).drifted()
    assert list(drifted) == ["balance"] and "arrives as JSON number" in next(
        iter(drifted["balance"])
    )


def test_a_delete_takes_its_key_from_the_kafka_key_and_a_foreign_key_is_refused():
    rows = _decode(
        [
            (b'{"id":7}', _value("d", {"id": None, "balance": None, "note": None}, 10)),
            (b'{"id":8}', _value("c", {"id": 9, "balance": _b64(1), "note": "x"}, 11)),
        ]
    )
    assert rows[0][ERROR] is None and rows[0]["id"] == 7 and rows[0]["_cdc_deleted"]
    assert rows[1][ERROR] == "the Kafka key's 'id' differs from the row's primary key"


def test_placeholders_are_no_value_in_toasted_columns_and_errors_elsewhere():
    placeholder = "__debezium_unavailable_value"
    rows = _decode(
        [
            (b'{"id":1}', _value("u", {"id": 1, "balance": _b64(5), "note": placeholder}, 10)),
            (b'{"id":1}', _value("u", {"id": 1, "balance": placeholder, "note": "n"}, 11)),
        ]
    )
    assert rows[0][ERROR] is None and rows[0]["note"] is None and not rows[0][has_value("note")]
    assert "list it under toasted_columns" in rows[1][ERROR]


def test_a_primary_key_update_names_the_old_key_from_its_header():
    header = [{"key": "__debezium.oldkey", "value": b'{"id":1}'}]
    row = {"id": 2, "balance": _b64(5), "note": "__debezium_unavailable_value"}
    rows = _decode([(b'{"id":2}', _value("c", row, 10), header)])
    assert rows[0][ERROR] is None and rows[0][MOVED_FROM] == {"id": 1}


def test_undeclared_columns_are_reported_with_the_type_that_holds_them():
    schema = json.loads(json.dumps(ROW_SCHEMA))
    schema["fields"].append(
        {
            "type": "int64",
            "optional": True,
            "name": "io.debezium.time.MicroTimestamp",
            "field": "seen",
        }
    )
    record = (
        b'{"id":1}',
        _value(
            "c", {"id": 1, "balance": _b64(5), "note": "x", "seen": 5}, 10, schema=_schema(schema)
        ),
    )
    shape = SourceShape.combine(r[SHAPE] for r in _decode([record]))
    assert added_column_types(shape, SPEC.columns) == {"seen": "timestamp"}
    rows = _decode([record], added_columns={"seen": "timestamp"})
    assert rows[0]["seen"] is not None and rows[0][ERROR] is None


def test_records_that_are_not_changes():
    rows = _decode(
        [
            (b'{"id":1}', None),
            (b'{"id":1}', b"{not json"),
            (b'{"id":1}', b'{"before":null,"after":{"id":1},"source":{"lsn":1}}'),
            (b'{"id":1}', b'{"op":"x","after":{"id":1},"source":{"lsn":1}}'),
            (b'{"id":1}', b'{"op":"c","after":{"id":1},"source":{}}'),
        ]
    )
    assert rows[0]["_cdc_is_tombstone"] and rows[0][ERROR] is None
    assert [r[ERROR] for r in rows[1:]] == [
        "value is not valid JSON",
        "envelope has no 'op' field",
        "unknown op",
        "sequence field 'source.lsn' is missing or not a bigint",
    ]
    assert rows[1]["value"] == b"{not json" and rows[0]["value"] is None


def test_a_schema_default_is_read_in_the_columns_encoding():
    """Debezium copies a column's DEFAULT into its Connect field schema, in the field's own
    encoding: a precise decimal's is base64, like its values. The shape reports it as the
    column's value (what the run records and gives changes written before the column)."""
    with_defaults = json.loads(json.dumps(ROW_SCHEMA))
    with_defaults["fields"][1]["default"] = _b64(150)  # balance numeric(14,2) DEFAULT 1.50
    with_defaults["fields"][2]["default"] = "none yet"
    date_type, micros = "io.debezium.time.Date", "io.debezium.time.MicroTimestamp"
    with_defaults["fields"] += [  # undeclared columns
        {"type": "int32", "optional": True, "default": 3, "field": "grade"},
        {"type": "int32", "name": date_type, "default": 1, "field": "since"},
        {"type": "int64", "name": micros, "default": 1_500_000, "field": "seen_at"},
        # MySQL's DEFAULT CURRENT_TIMESTAMP, as Debezium writes it: not a value rows hold.
        {"type": "int64", "name": micros, "default": 0, "field": "created_at"},
    ]
    row = {"id": 1, "balance": _b64(1), "note": None, "grade": 4}
    row |= {"since": 2, "seen_at": 5, "created_at": 6}
    rows = _decode([(b'{"id":1}', _value("c", row, 1, schema=_schema(with_defaults)))])
    shape = SourceShape.combine(r[SHAPE] for r in rows)
    assert shape.source_defaults() == {
        "balance": "1.50",
        "note": "none yet",
        "grade": 3,
        "since": "1970-01-02",
        "seen_at": "1970-01-01T00:00:01.500000+00:00",
    }
    # A default that changed within the hour is not taken: which one the rows hold is unsure.
    other = json.loads(json.dumps(with_defaults))
    other["fields"][2]["default"] = "other"
    rows += _decode([(b'{"id":2}', _value("c", {**row, "id": 2}, 2, schema=_schema(other)))])
    assert "note" not in SourceShape.combine(r[SHAPE] for r in rows).source_defaults()


# Debezium's MariaDB connector, as captured (docs/debezium.md): `flag TINYINT(1) NOT NULL
# DEFAULT 0` since CREATE TABLE, then `ALTER TABLE ... ADD COLUMN grade INT NOT NULL DEFAULT 7`.
FLAGS = TableSpec(
    name="flags",
    topic="t",
    primary_key=("id",),
    columns={"id": "bigint", "flag": "int", "grade": "int"},
    start_hour="2026-11-01-00:00",
)
CREATED = {
    "type": "struct",
    "optional": True,
    "fields": [
        {"type": "int64", "optional": False, "field": "id"},
        {"type": "int16", "optional": False, "default": 0, "field": "flag"},
    ],
}
ALTERED = {
    **CREATED,
    "fields": [
        *CREATED["fields"],
        {"type": "int32", "optional": False, "default": 7, "field": "grade"},
    ],
}


def test_the_shape_names_the_columns_a_changes_own_schema_lacks():
    """A change whose schema lacks a declared column was written before the source table had it
    (`SourceShape.absent`, what schema_drift's undeclared defaults rest on); a column the table
    had since it was created is in every change's schema, and never absent. Both passes."""
    before = (b'{"id":2}', _value("u", {"id": 2, "flag": 0}, 1, schema=_schema(CREATED)))
    after = (b'{"id":6}', _value("c", {"id": 6, "flag": 0, "grade": 7}, 2, schema=_schema(ALTERED)))
    for records, absent in (([after], set()), ([before, after], {"grade"})):
        for fast in (True, False):
            rows = _decode(records, FLAGS, fast=fast)
            assert [r[ERROR] for r in rows] == [None] * len(records)
            shape = SourceShape.combine(r[SHAPE] for r in rows)
            assert shape.absent == absent
            assert shape.source_defaults() == {"flag": 0, "grade": 7}
