"""The batch decoder's fast pass against its exact pass alone (`cdc_assets.decoding`).

Batches of records are drawn from parts that each stress one rule: good changes and deletes,
tombstones, values of the wrong JSON kind, out of range or with too many decimal places,
placeholders, absent and undeclared columns, keys naming another row, wrapped records under
two schemas, truncates, JSON the fast parser refuses (NaN, numbers past a double) or reads the
way the exact one does (duplicate keys). Each batch is decoded twice, with a fresh decoder each
time: column at a time, and record by record; the two Arrow batches, the tally and the source
shape included, must be equal. Pure Python: no Spark.
"""

from __future__ import annotations

import base64
import json
from datetime import date
from decimal import Decimal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_assets.columns import ERROR
from cdc_assets.config import TableSpec
from cdc_assets.decoding import batch as batch_module
from tests.cdc_assets.decoder_records import (
    PLACEHOLDER,
    _b64,
    assert_same,
    batch_of,
    debezium_record,
    decode_both,
    spec_for,
    wrapped_schema,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    decimal_handling=st.sampled_from(["string", "precise"]),
    records=st.data(),
    added=st.booleans(),
    raw=st.booleans(),
    defaults=st.booleans(),
)
def test_the_fast_pass_gives_the_exact_passs_batch(decimal_handling, records, added, raw, defaults):
    spec = spec_for(decimal_handling)
    if raw:  # a hard expectation keeps every record's bytes
        hard = {"column": "n", "expect": "not_null", "hard": True}
        spec = TableSpec.model_validate({**spec.model_dump(), "expectations": [hard]})
    if defaults:  # what a change from before a column existed gives it
        values = {"n": 7, "note": "none yet", "day": "2026-01-02", "amount": "1.50"}
        values["at"] = "2026-01-02T03:04:05.678901+00:00"
        spec = TableSpec.model_validate({**spec.model_dump(), "defaults": values})
    drawn = records.draw(st.lists(debezium_record(decimal_handling), min_size=0, max_size=40))
    plan = {"added_columns": {"extra": "bigint"}} if added else {}
    assert_same(*decode_both(spec, batch_of(drawn), **plan))


def test_a_change_from_before_a_column_existed_takes_its_default_and_no_error():
    """`ALTER TABLE ... ADD COLUMN`: a record whose own schema lacks a declared column was
    written before it existed; without a schema a row that lacks one too. Both passes give the
    declared default (null without one); a row that lacks a column its schema names is an
    error whose reason says what to fix."""
    values = {"n": 7, "note": "none yet", "day": "2026-01-02", "amount": "1.50"}
    spec = TableSpec.model_validate({**spec_for("string").model_dump(), "defaults": values})
    good = {"id": 1, "n": 2, "amount": "12.30", "price": 1.5, "flag": True, "note": "x"}
    good |= {"at": 5, "day": 3, "blob": None}
    older = json.loads(json.dumps(wrapped_schema(True, "n")))
    older["fields"][1]["fields"] = [
        f for f in older["fields"][1]["fields"] if f["field"] not in ("note", "day")
    ]

    def record(n: int, row: dict, schema: dict | None) -> tuple:
        envelope = {"before": None, "after": row, "source": {"lsn": n, "ts_ms": 1}, "op": "c"}
        document = envelope if schema is None else {"schema": schema, "payload": envelope}
        return b'{"id":%d}' % n, json.dumps(document).encode(), None

    lacking = {k: v for k, v in good.items() if k not in ("n", "note", "day")}
    records = [
        record(1, {**lacking, "id": 1}, older),  # the schema from before n, note and day
        record(2, {**lacking, "id": 2}, None),  # no schema: the row says what it had
        record(3, {**lacking, "id": 3}, wrapped_schema(True)),  # the schema names them
        record(4, {**good, "id": 4}, wrapped_schema(True)),
    ]
    fast, exact = decode_both(spec, batch_of(records))
    assert_same(fast, exact)
    rows = fast.to_pylist()
    for row in rows[:2]:
        assert row[ERROR] is None
        assert (row["n"], row["note"], row["day"]) == (7, "none yet", date(2026, 1, 2))
    assert "column 'n' is missing from 'after' although the record's own schema" in rows[2][ERROR]
    assert (rows[3]["n"], rows[3]["note"], rows[3][ERROR]) == (2, "x", None)
    plain = spec_for("string")  # no defaults: null, still no error
    rows = decode_both(plain, batch_of(records[:2]))[0].to_pylist()
    assert [(r["n"], r["note"], r[ERROR]) for r in rows] == [(None, None, None)] * 2


def test_a_batch_of_good_changes_takes_the_fast_pass_and_bad_ones_keep_their_reasons(
    monkeypatch,
):
    # The records the fast pass leaves to the exact pass, as the batch hands them over.
    left_to_exact: list[int] = []
    exact_part = batch_module.exact_part

    def counted(decoder, records, rows, *rest):
        left_to_exact.extend(rows)
        return exact_part(decoder, records, rows, *rest)

    monkeypatch.setattr(batch_module, "exact_part", counted)
    spec = spec_for("string")
    good = {
        "id": 1,
        "n": 2,
        "amount": "12.30",
        "price": 1.5,
        "flag": True,
        "note": "x",
        "at": 5,
        "day": 3,
        "blob": None,
    }
    records = []
    for n in range(1, 101):
        row = {**good, "id": n}
        if n == 50:
            row["amount"] = "12.345"
        value = json.dumps(
            {"before": None, "after": row, "source": {"lsn": n, "ts_ms": 1}, "op": "u"}
        ).encode()
        records.append((b'{"id":%d}' % n, value, None))
    fast, exact = decode_both(spec, batch_of(records))
    assert_same(fast, exact)
    # The exact pass alone got all 100 (fast=False); of the fast pass's batch, only the bad one.
    assert left_to_exact == [49, *range(100)]
    errors = fast.column(ERROR).to_pylist()
    assert errors.count(None) == 99
    assert "more than 2 decimal places" in errors[49]
    assert fast.column("amount").to_pylist()[0] == Decimal("12.30")


# Every configurable encoding and the Connect types without one, as (declared, the column's
# `encoding` setting, its Connect field schema, values it reads, values it refuses). Both passes
# read values by the same rules, so what matters is that they agree on every one of them.
_MICROS = 1_764_000_000_000_000
EVERY_ENCODING = {
    "id": ("bigint", None, {"type": "int64"}, [1, 2, 3], ["1", 2**63]),
    "f": ("float", None, {"type": "float"}, [1.5, 0.0, 3], ["1", True]),
    "year": ("int", None, {"type": "int32", "name": "io.debezium.time.Year"}, [2026], [1.5]),
    "t_micro": (
        "time",
        "MicroTime",
        {"type": "int64", "name": "io.debezium.time.MicroTime"},
        [0, 3_600_000_000, 86_399_999_999],
        ["10:00", 1.5],
    ),
    "t_ms": (
        "time",
        "Time",
        {"type": "int32", "name": "io.debezium.time.Time"},
        [0, 45_000],
        ["x"],
    ),
    "t_nano": (
        "time",
        "NanoTime",
        {"type": "int64", "name": "io.debezium.time.NanoTime"},
        [1_000, 1_000_000_000],
        [1, "1"],
    ),
    "ts_ms": (
        "timestamp",
        "Timestamp",
        {"type": "int64", "name": "io.debezium.time.Timestamp"},
        [_MICROS // 1000, 0, -62_135_596_800_000],
        [1.5, 253_402_300_800_000],
    ),
    "ts_nano": (
        "timestamp",
        "NanoTimestamp",
        {"type": "int64", "name": "io.debezium.time.NanoTimestamp"},
        [_MICROS * 1000, 0],
        [_MICROS * 1000 + 1],
    ),
    "ts_zoned": (
        "timestamp",
        "ZonedTimestamp",
        {"type": "string", "name": "io.debezium.time.ZonedTimestamp"},
        ["2026-11-02T06:00:00Z", "2026-11-02T08:00:00.123456+02:00", "0001-01-01T00:00:00Z"],
        ["2026-11-02", 5, "2026-11-02T06:00:00.1234567Z"],
    ),
    "dec_vs": (
        "decimal(12,3)",
        "variable_scale",
        {"type": "struct", "name": "io.debezium.data.VariableScaleDecimal"},
        [{"scale": 2, "value": _b64(1230)}, {"scale": 0, "value": _b64(-5)}],
        [{"scale": 4, "value": _b64(12345)}, "1.0", {"scale": 1}],
    ),
    "dec_double": ("decimal(12,3)", "double", {"type": "double"}, [12.5, 0.125, 3], [1e-4, "1"]),
    "dec_text": ("decimal(12,3)", "string", {"type": "string"}, ["1.500", "-3"], ["1e3", "1.2345"]),
    # With a schema, the connector names such text a string: the schema here says bytes.
    "bin_b64": ("binary", "base64", {"type": "bytes"}, ["YWI=", ""], ["!!", 5]),
    "bin_hex": ("binary", "hex", {"type": "bytes"}, ["6162", ""], ["zz", "616"]),
    "arr": (
        "array<bigint>",
        None,
        {"type": "array", "items": {"type": "int64"}},
        [[1, 2], []],
        [["x"], 5, [1.5]],
    ),
    "arr_t": (
        "array<string>",
        None,
        {"type": "array", "items": {"type": "string"}},
        [["a"], [PLACEHOLDER]],
        [[1], [PLACEHOLDER, "b"]],
    ),
    "bin_t": (
        "binary",
        None,
        {"type": "bytes"},
        [_b64(97), base64.b64encode(PLACEHOLDER.encode()).decode()],
        ["!", PLACEHOLDER + "x"],
    ),
    "note": ("string", None, {"type": "string", "name": "io.debezium.data.Json"}, ["{}"], [5]),
}
# A schema that names another type than the table declares: every value is a mismatch.
_WRONG_SCHEMA = {"type": "boolean"}


def _every_encoding_spec() -> TableSpec:
    return TableSpec(
        name="wide",
        topic="t",
        primary_key=("id",),
        columns={name: column[0] for name, column in EVERY_ENCODING.items()},
        encodings={name: column[1] for name, column in EVERY_ENCODING.items() if column[1]},
        toasted_columns=("arr_t", "bin_t", "note"),
        start_hour="2026-11-01-00:00",
    )


@st.composite
def _every_encoding_record(draw) -> tuple:
    row = {}
    for name, (_, _, _, good, bad) in EVERY_ENCODING.items():
        # One value in thirty refused, null or a placeholder: about half the rows are all good.
        refused = draw(st.integers(0, 29)) == 0
        row[name] = draw(st.sampled_from([*bad, None, PLACEHOLDER] if refused else good))
    op = draw(st.sampled_from(["c", "u", "r", "d"]))
    envelope = {
        "before": row if op == "d" else None,
        "after": None if op == "d" else row,
        "source": {"lsn": draw(st.integers(1, 99)), "ts_ms": 1_793_491_657_373},
        "op": op,
    }
    document: dict = envelope
    if draw(st.booleans()):  # wrapped in a Connect schema, now and then a contradicting one
        wrong = (
            draw(st.sampled_from(list(EVERY_ENCODING))) if draw(st.integers(0, 9)) == 0 else None
        )
        fields = [
            {**(_WRONG_SCHEMA if name == wrong else column[2]), "optional": True, "field": name}
            for name, column in EVERY_ENCODING.items()
        ]
        row_schema = {"type": "struct", "optional": True, "fields": fields}
        schema = {
            "type": "struct",
            "fields": [{**row_schema, "field": "before"}, {**row_schema, "field": "after"}],
        }
        document = {"schema": schema, "payload": envelope}
    named = row["id"] if draw(st.integers(0, 9)) and type(row["id"]) is int else 2
    key = b'{"id":%d}' % named  # now and then naming another row
    return key, json.dumps(document, separators=(",", ":")).encode(), None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(_every_encoding_record(), min_size=1, max_size=30))
def test_both_passes_read_every_encoding_alike(records):
    """Records of every supported encoding, with mismatching values, mismatching schemas and
    placeholders in toasted and other columns: the same rows and the same error reasons."""
    fast, exact = decode_both(_every_encoding_spec(), batch_of(records))
    assert_same(fast, exact)
