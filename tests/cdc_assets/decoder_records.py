"""Debezium records for the decoder's differential tests, drawn by Hypothesis from parts that
each stress one rule (test_batch_decode.py: the fast pass against the exact pass;
test_decoder_input.py: Spark's narrowed input against the whole records).
"""

from __future__ import annotations

import base64
import json
import math

import pyarrow as pa
from hypothesis import strategies as st

from cdc_assets.config import TableSpec
from cdc_assets.decoding.batch import decode_batch
from cdc_assets.decoding.exact import RecordDecoder
from cdc_assets.decoding.plan import DecodePlan

COLUMNS = {
    "id": "bigint",
    "n": "int",
    "amount": "decimal(10,2)",
    "price": "double",
    "flag": "boolean",
    "note": "string",
    "at": "timestamp",
    "day": "date",
    "blob": "binary",
}
PLACEHOLDER = "__debezium_unavailable_value"


def spec_for(decimal_handling: str) -> TableSpec:
    return TableSpec(
        name="things",
        topic="t",
        primary_key=("id",),
        columns=COLUMNS,
        toasted_columns=("note",),
        decimal_handling=decimal_handling,
        start_hour="2026-11-01-00:00",
    )


def _b64(unscaled: int) -> str:
    size = max(1, (unscaled.bit_length() + 8) // 8)
    return base64.b64encode(unscaled.to_bytes(size, "big", signed=True)).decode()


# Per column: values its encoding reads, then values it refuses (the last ones, less often).
GOOD = {
    "id": [1, 2, 3, 2**62],
    "n": [0, -5, 2**31 - 1, None],
    "price": [1.5, 0.0, -2.25, 3, None],
    "flag": [True, False, None],
    "note": ["x", "", "ünï", None, PLACEHOLDER],
    "at": [0, 1_764_000_000_000_000, -1, None],
    "day": [0, 20_000, -719_162, None],
    "blob": [base64.b64encode(b"ab").decode(), None],
}
BAD = {
    "id": ["1", 1.0, True, 2**63],
    "n": [2**31, "5", 1.5, False],
    "price": ["1.5", True, {"a": 1}],
    "flag": [1, "true"],
    "note": [5, ["x"], {"a": "b"}],
    "at": [253_402_300_800_000_000, "2026-01-01T00:00:00Z", 1.5],
    "day": [2_932_897, "2026-01-01"],
    "blob": ["not base64!", 7],
}
AMOUNT_TEXT = ["12.30", "-0.00", "99999999.99", "7", None]
AMOUNT_TEXT_BAD = ["12.345", "100000000.00", "1e5", " 1", 12.3, _b64(1230), PLACEHOLDER]
AMOUNT_PRECISE = [_b64(1230), _b64(-5), None]
AMOUNT_PRECISE_BAD = ["12.30", "1234", 12, _b64(10**12)]

ROW_SCHEMA = {
    "type": "struct",
    "optional": True,
    "fields": [
        {"type": "int64", "optional": False, "field": "id"},
        {"type": "int32", "optional": True, "field": "n"},
        {
            "type": "bytes",
            "optional": True,
            "name": "org.apache.kafka.connect.data.Decimal",
            "parameters": {"scale": "2"},
            "field": "amount",
        },
        {"type": "double", "optional": True, "field": "price"},
        {"type": "boolean", "optional": True, "field": "flag"},
        {"type": "string", "optional": True, "field": "note"},
        {
            "type": "int64",
            "optional": True,
            "name": "io.debezium.time.MicroTimestamp",
            "field": "at",
        },
        {"type": "int32", "optional": True, "name": "io.debezium.time.Date", "field": "day"},
        {"type": "bytes", "optional": True, "field": "blob"},
    ],
}


def wrapped_schema(text_amount: bool, lacks: str | None = None) -> dict:
    row = json.loads(json.dumps(ROW_SCHEMA))
    if text_amount:  # the same table under decimal.handling.mode=string
        row["fields"][2] = {"type": "string", "optional": True, "field": "amount"}
    if lacks is not None:  # the table before `ALTER TABLE ... ADD COLUMN <lacks>`
        row["fields"] = [f for f in row["fields"] if f["field"] != lacks]
    return {
        "type": "struct",
        "fields": [
            {**row, "field": "before"},
            {**row, "field": "after"},
            {"type": "string", "optional": False, "field": "op"},
        ],
    }


@st.composite
def _row(draw, amounts: list, amounts_bad: list) -> dict:
    row = {}
    for column in COLUMNS:
        if column == "amount":
            good, bad = amounts, amounts_bad
        else:
            good, bad = GOOD[column], BAD[column]
        row[column] = draw(
            st.sampled_from(good) if draw(st.integers(0, 19)) else st.sampled_from(bad)
        )
    shape = draw(st.integers(0, 29))
    if shape == 0:
        row.pop(draw(st.sampled_from(sorted(COLUMNS))))  # a declared column absent
    elif shape == 1:
        row["extra"] = draw(st.sampled_from([1, "x", None, 2.5, [1], {"a": 1}]))
    return row


@st.composite
def debezium_record(draw, decimal_handling: str) -> tuple:
    wrapped = draw(st.integers(0, 3)) == 0
    text_amount = decimal_handling == "string"
    if wrapped:
        text_amount = draw(st.booleans())
    amounts = AMOUNT_TEXT if text_amount else AMOUNT_PRECISE
    amounts_bad = AMOUNT_TEXT_BAD if text_amount else AMOUNT_PRECISE_BAD
    kind = draw(st.integers(0, 39))
    key_id = draw(st.sampled_from([1, 2, 3, 2**62]))
    row = draw(_row(amounts, amounts_bad))
    if kind < 30:
        row["id"] = key_id if draw(st.integers(0, 9)) else row.get("id")
    op = draw(st.sampled_from(["c", "u", "r", "u", "d", "d"] if kind < 36 else ["t", "x", None]))
    lsn = draw(st.sampled_from([10, 11, 2**40, "12", None]) if kind == 37 else st.integers(1, 99))
    envelope = {
        "before": row if op == "d" else draw(st.sampled_from([None, row])),
        "after": None if op == "d" else row,
        "source": {"lsn": lsn, "ts_ms": draw(st.sampled_from([1_793_491_657_373, None, "x"]))},
        "op": op,
    }
    if op == "d" and draw(st.booleans()):
        envelope["before"] = {"id": None}  # Postgres' default replica identity: key only
    # A record written before a column existed: its schema and its row lack the column.
    lacks = (
        draw(st.sampled_from([None, None, None, "n", "note", "blob", "amount", "day", "at"]))
        if wrapped
        else None
    )
    if lacks is not None:
        for image in (envelope["before"], envelope["after"]):
            if isinstance(image, dict):
                image.pop(lacks, None)
    document = (
        {"schema": wrapped_schema(text_amount, lacks), "payload": envelope} if wrapped else envelope
    )
    value = json.dumps(document, separators=(",", ":")).encode()
    trick = draw(st.integers(0, 39))
    if trick == 0:
        value = None  # a tombstone
    elif trick == 1:
        value = value[:-3]  # torn JSON
    elif trick == 2:
        value = value.replace(b'"price":1.5', b'"price":NaN')  # JSON the fast parser refuses
    elif trick == 3:
        value = value.replace(b'"price":1.5', b'"price":1e400')
    elif trick == 4 and not wrapped:
        value = value[:-1] + b',"op":"d"}'  # a duplicate key: the last one counts
    key_choice = draw(st.integers(0, 9))
    if key_choice == 0:
        key = None
    elif key_choice == 1:
        key = b'{"id":%d}' % draw(st.sampled_from([1, 5, 2**62]))
    elif key_choice == 2:
        key = b"not json"
    elif key_choice == 3:
        key = json.dumps(
            {
                "schema": {"type": "struct", "fields": [ROW_SCHEMA["fields"][0]]},
                "payload": {"id": key_id},
            }
        ).encode()
    else:
        key = b'{"id":%d}' % key_id
    headers = None
    if draw(st.integers(0, 19)) == 0:
        headers = [{"key": "__debezium.oldkey", "value": b'{"id":%d}' % draw(st.integers(1, 3))}]
    return key, value, headers


def batch_of(records: list[tuple]) -> pa.RecordBatch:
    count = len(records)
    return pa.RecordBatch.from_pydict(
        {
            "key": pa.array([r[0] for r in records], pa.binary()),
            "value": pa.array([r[1] for r in records], pa.binary()),
            "topic": ["t"] * count,
            "partition": pa.array([n % 2 for n in range(count)], pa.int32()),
            "offset": pa.array([100 + n // 2 for n in range(count)], pa.int64()),
            "timestamp": pa.array([0] * count, pa.timestamp("ms", tz="UTC")),
            "headers": pa.array(
                [r[2] for r in records],
                pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())])),
            ),
        }
    )


def decode_both(spec: TableSpec, batch: pa.RecordBatch, **plan) -> tuple:
    fast = RecordDecoder(DecodePlan.of(spec, hour_key="2026-11-02-06:00", **plan))
    exact = RecordDecoder(DecodePlan.of(spec, hour_key="2026-11-02-06:00", **plan))
    return decode_batch(fast, batch), decode_batch(exact, batch, fast=False)


def _same(a, b) -> bool:
    """Equal, a NaN equal to a NaN (a delete keeps a before-image's NaN double)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def assert_same(fast: pa.RecordBatch, exact: pa.RecordBatch) -> None:
    assert fast.schema == exact.schema
    for name in exact.schema.names:
        got, want = fast.column(name).to_pylist(), exact.column(name).to_pylist()
        assert _same(got, want), f"column {name} differs: {got} != {want}"
