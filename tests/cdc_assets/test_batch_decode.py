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

import json
from datetime import date
from decimal import Decimal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_assets.columns import ERROR
from cdc_assets.config import TableSpec
from tests.cdc_assets.decoder_records import (
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


def test_a_batch_of_good_changes_takes_the_fast_pass_and_bad_ones_keep_their_reasons():
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
    errors = fast.column(ERROR).to_pylist()
    assert errors.count(None) == 99
    assert "more than 2 decimal places" in errors[49]
    assert fast.column("amount").to_pylist()[0] == Decimal("12.30")
